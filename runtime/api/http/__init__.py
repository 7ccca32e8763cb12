"""The OpenAI-compatible HTTP front: the FastAPI app and its routes, the address it binds, and
the asyncio client it talks to the server with."""
