"""`loom simulate`: its accuracy against the served engine, fleets of replicas."""
