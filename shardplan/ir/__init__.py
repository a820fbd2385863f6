"""The two data structures the planner works on: the traced step as a graph of tensors, and the ILP's problem."""
