"""Planning on a live model: measured stage costs, and the planner's choice of cut and device mapping."""
