"""The planner's doors: `hybridpar plan` / `calibrate`, `train --parallel.auto`, explanations, fits to runs."""
