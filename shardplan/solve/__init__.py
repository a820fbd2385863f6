"""The ILP and its helpers: exact simplification, tying repeated layers, exact elimination, the OR-Tools solve."""
