def run():
    print("placeholder")
