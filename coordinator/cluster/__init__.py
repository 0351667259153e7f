"""The fleet: worker actors on Ray, the embedded Redis, deployments for the CLI and tests."""
