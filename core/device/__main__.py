from gputravel.core.device.entry import main

main()
