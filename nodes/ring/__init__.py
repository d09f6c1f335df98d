"""The ring actor: a node, its links and inbox, the head it may hold, membership, recovery, and its gRPC services."""
