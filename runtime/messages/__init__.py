"""Typed messages between the server's processes: one module per channel (see `weft.runtime.ipc`).

Every message is a tagged `msgspec.Struct` encoded with msgpack; no pickling.
"""
