"""A test proposer whose drafts come from known continuations, some replaced at random."""

import random


class OracleProposer:
    """Drafts from known continuations (prompt -> the tokens non-speculative decoding
    generates), each replaced by a random token with probability ``p_wrong``."""

    def __init__(self, references, p_wrong, seed=0):
        self.references = references
        self.p_wrong = p_wrong
        self.rng = random.Random(seed)

    def propose(self, token_ids, num_drafts):
        tokens = tuple(token_ids.tolist())
        for prompt, output in self.references.items():
            if tokens[:len(prompt)] == prompt:
                cont = output[len(tokens) - len(prompt):][:self.rng.randint(0, num_drafts)]
                return [self.rng.randrange(400) if self.rng.random() < self.p_wrong else t
                        for t in cont]
        return []
