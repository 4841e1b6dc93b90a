"""Scenario files: the strict structs (`spec`), the matrix of transfer axes made from the engine's `TransferAxes`
(`matrix`), reading and validating a file (`load`), and the sizes and checks that need the model's layout, with the
`--quick` shrink (`sizes`). The tables a scenario shares with its engines and workload kinds (`[model]`,
`[prefill]`, `[server]`) and the strict base live below it, at the harness's top (`model_shape`, `prefill`,
`server_spec`, `strict`): the scenario decodes through the engines and the kinds, never the other way."""
