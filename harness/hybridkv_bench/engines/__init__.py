"""The engines a case runs: simulated (`sim`), vLLM's scheduler (`vllm`), a real transformers model (`hf`),
in threads or as processes (`procs`), and the request step they share (`step`)."""
