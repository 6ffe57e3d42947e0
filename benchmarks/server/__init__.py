"""`loom serve`: start-up, what HTTP costs, long answers, the soak, Ray replicas."""
