"""The travel engine: the visit state machine, the schedule, holder links."""
