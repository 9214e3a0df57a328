"""What a job's bubbles are worth before it runs: the schedule model and measured use (``freeride plan``)."""
