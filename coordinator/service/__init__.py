"""The front door: gRPC service, interceptor (auth, limits), TLS, admin, detokenizing."""
