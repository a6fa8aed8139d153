"""Speculative decoding on the host: the ``Speculator`` the engine asks for drafts before each
schedule, its proposers (n-gram prompt lookup, a suffix trie, a draft model) and the arithmetic
of adaptive draft lengths. Drafts are verified inside the jitted step
(jaxkv/sample/rejection.py)."""
