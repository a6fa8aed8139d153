"""What users run: the ``jaxkv`` command line (generate, chat, bench, serve, plan, convert, eval)
and the retained-perplexity evaluation. The OpenAI server lives in jaxkv/server/."""
