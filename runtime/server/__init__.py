"""The HTTP server process: FastAPI routes (native SGLang-style and OpenAI-compatible), the
tokenizer manager, and the launcher that starts the scheduler and detokenizer processes."""
