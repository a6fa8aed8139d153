"""Block ownership on the host (no jax): the block manager (free queue, ref counts, block
tables), the prefix cache it indexes (hash chain, radix tree) and the host tier behind it
(demoted prefix blocks, swapped sequences). The scheduler is their only driver."""
