"""`quantship bench`: a load generator for any OpenAI-compatible server.

prompts.py builds requests, client.py streams one over aiohttp and times it, load.py shapes
arrivals into steps, stats.py turns a step into vLLM-compatible figures, compare.py gates against a
baseline, output.py and plots.py write the files, console.py draws progress and tables, run.py ties
them together for the CLI, stub.py is a server with known delays to check the generator against.
"""
