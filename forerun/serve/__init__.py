"""`forerun serve`: an OpenAI-compatible HTTP server over a continuously batched engine.

Only this package and the CLI's `serve` subcommand import the server stack (FastAPI,
uvicorn, prometheus-client), so `import forerun` stays light.
"""
