"""What a user holds: `Client` (a running `tandem serve`), `Engine` (launches one and owns it),
the outputs they return, and the OpenAI-compatible HTTP front over a Client."""
