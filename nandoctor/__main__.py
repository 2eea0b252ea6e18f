from nandoctor.cli import main

main()
