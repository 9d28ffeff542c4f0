"""Pure codecs of text and files: chat templates, constraints, reasoning blocks, tool calls, the
text of a stream, and saved conversations. Neither llama.cpp nor an event loop."""
