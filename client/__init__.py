"""The site agent: connects out to the coordinator, runs installed tasks, ships updates."""
