"""Layout search: enumerate, reject by rule or memory, rank by predicted step time; the cp mode."""
