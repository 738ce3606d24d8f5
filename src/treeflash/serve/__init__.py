"""`treeflash serve`: an OpenAI-compatible HTTP server over the lossless speculative decoding engine.

openai_api: OpenAI's request, answer and error shapes; text: tokens to text, cut at stop strings; worker: the one
decoding thread behind a bounded queue; metrics: Prometheus text; app: the FastAPI routes.
"""

# OpenAI's, for a request that leaves temperature out (`serve --default-temperature`); here, where the command line
# reads it without importing the server's stack (pydantic, FastAPI)
DEFAULT_TEMPERATURE = 1.0
