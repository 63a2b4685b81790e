"""`python -m nanscan`: the same program as the `nanscan` console script."""

from nanscan.cli.main import main

if __name__ == "__main__":
    main()
