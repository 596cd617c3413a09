"""Kernel families: per family one module holding the launcher(s) and the numpy twin(s).

Launchers take `(backend, stream, <pointers and sizes>)`, check what can be checked about
sizes before anything is launched, and call `backend.launch` with `DevicePtr` pointers and
np.int32 / np.float32 scalars, in the order of the `.cu` entry point.
"""
