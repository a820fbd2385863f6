"""How each primitive relates its operands' shardings (the rules), the candidate shardings and their prices (the
strategies), and the plan applied back onto the step as sharding constraints."""
