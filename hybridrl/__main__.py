"""`python -m hybridrl ...` starts the Hydra app."""

from hybridrl.app import main

if __name__ == "__main__":
    main()
