"""The deployment files (Dockerfiles, Compose, ECS, CloudFormation, the Grafana dashboard): read statically, and their
commands and health probes run for real."""
