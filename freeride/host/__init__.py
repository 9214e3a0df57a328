"""What FreeRide does with the node's processes: cgroups, process trees, run-queue delays, the jobs a manager serves."""
