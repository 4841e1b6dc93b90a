"""Scenario files: the strict structs (`spec`), reading and validating a file (`load`), and the sizes and
checks that need the model's layout, with the `--quick` shrink (`sizes`)."""
