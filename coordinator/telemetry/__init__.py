"""What operators see: request records, metrics families, log formats and the metrics endpoint."""
