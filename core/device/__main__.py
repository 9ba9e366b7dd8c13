from gputravel.core.device.server import main

main()
