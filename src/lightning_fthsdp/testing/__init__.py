"""What the project's tests and soaks check runs with: the run invariants (``invariants``) and the chaos soak
(``soak``). Shipped in the package so a user can check their own runs' records the same way."""
