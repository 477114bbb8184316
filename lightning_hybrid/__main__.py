from lightning_hybrid.cli import main

main()
