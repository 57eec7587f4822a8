"""The planner: hardware specs, memory and cost models, layout search (see design.md)."""
