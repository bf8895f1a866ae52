"""h3serve: MiniMax-H3 served as gRPC microservices. docs/architecture.md maps the rooms of this package."""
