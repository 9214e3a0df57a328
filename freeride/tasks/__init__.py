"""Side tasks by name, what a task class declares, plain programs' options, and step-time estimates."""
