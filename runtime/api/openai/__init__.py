"""OpenAI's wire shapes: request bodies into tandem's arguments, results into OpenAI's reply
bodies (logprobs, token strings, structured outputs), and its error object."""
