"""Scenario files: the strict structs (`spec`), the matrix of transfer axes made from the engine's `TransferAxes`
(`matrix`), reading and validating a file (`load`), and the sizes and checks that need the model's layout, with the
`--quick` shrink (`sizes`)."""
