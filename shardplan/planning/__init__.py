"""From a traced step to a plan (the planner) and the outer search over the parallelism families around it."""
