"""The coordinator: prefix index, router, request path (service, index, routing, cluster, sim)."""
