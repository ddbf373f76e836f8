"""Third-party allocators behind the kvfuzz contract. Each adapter imports its engine lazily."""
