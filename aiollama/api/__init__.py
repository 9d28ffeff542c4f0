"""The callers' side: ``Engine`` and ``SyncEngine``, conversations and their streams, the client
that sends commands to the decode thread, and the portal through which its answers come back into
each event loop (anyio: asyncio and trio)."""
