"""The Executor over llama.cpp: the only code besides ``aiollama.native`` that calls it (the model,
the context, sampling, the tokenizer, embeddings, the draft model). It runs on the decode thread."""
