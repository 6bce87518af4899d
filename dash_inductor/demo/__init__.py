"""The command line and its demo (``cli.py``), and the small GPT it trains (``tiny_gpt.py``)."""
