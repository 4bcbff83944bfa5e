"""The puzzles' solutions, one module per puzzle (kvlab.puzzles): read one only once you have tried."""
