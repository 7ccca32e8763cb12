"""Tool calls: the request's `tools` and `tool_choice` checked, the grammar that forces a
call, and the parsers that read calls out of generated text, whole or streamed."""
