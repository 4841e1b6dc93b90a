"""The model shape and what the cache stores of it: group layouts (`layout`), the model presets
(`presets`, a module per family), chunk keys (`keys`), what a chunk stores or loads (`policy`),
and a model's identity in namespaces (`model_identity`). Imports nothing else of hybridkv."""
