"""The KV cache on the device and behind it: the paged pool pytree and its reads and writes
(pages.py), the KV formats (spec.py, quant.py), the step's attention metadata, and the host and
disk stores that hold pages off the device (host_pool.py, disk_store.py)."""
