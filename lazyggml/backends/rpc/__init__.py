"""GGML's RPC backend: remote devices over TCP, speaking llama.cpp's ``ggml-rpc`` protocol (7.0.0).

* ``protocol.py``: the wire format (commands, the tensor record, op ids, framing);
* ``client.py``: a remote device as one more backend (device, buffer type, buffers, backend), so
  the scheduler splits graphs over it like over a local GPU (``lg.rpc_device("host:port")``);
* ``server.py``: serves any lazyggml device to RPC clients, lazyggml's and llama.cpp's alike
  (``lazyggml rpc-server``).

The protocol has no authentication: a server listens on 127.0.0.1 unless told otherwise.
"""
