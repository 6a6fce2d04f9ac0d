"""The tool-call validity set: twelve functions whose parameter schemas differ in shape, and 60
requests written for this project (five per function), each answered best by one function.

Shapes covered: flat strings and enums; bounded integers and numbers; a string pattern; an
optional array; a nested object; an array of objects; a nullable field (`type: [..., "null"]`);
`anyOf` alternatives; a boolean; `additionalProperties: false` everywhere but one function. Each
request is offered its own function and two others (fixed, chosen by index), in that order
rotated, so that the right answer is not always first.
"""

from __future__ import annotations

from typing import Any

S = {"type": "string"}


def _obj(properties: dict[str, Any], required: list[str], closed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if closed:
        schema["additionalProperties"] = False
    return schema


FUNCTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "get_weather": ("Current weather for a city.", _obj(
        {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])),
    "add_numbers": ("Add two integers.", _obj(
        {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])),
    "search_flights": ("Search flights between two airports (IATA codes).", _obj(
        {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
         "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
         "date": {"type": "string", "description": "YYYY-MM-DD"},
         "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        ["origin", "destination", "date"])),
    "send_email": ("Send an email.", _obj(
        {"to": S, "subject": S, "body": S, "cc": {"type": "array", "items": S}},
        ["to", "subject", "body"])),
    "set_thermostat": ("Set the home thermostat.", _obj(
        {"temperature": {"type": "number", "minimum": 5, "maximum": 35},
         "mode": {"enum": ["heat", "cool", "auto"]}}, ["temperature", "mode"])),
    "create_order": ("Place an order for products.", _obj(
        {"items": {"type": "array", "minItems": 1, "items": _obj(
            {"product": S, "quantity": {"type": "integer", "minimum": 1}},
            ["product", "quantity"])},
         "express": {"type": "boolean"}}, ["items"])),
    "book_table": ("Reserve a table at a restaurant.", _obj(
        {"restaurant": S, "time": {"type": "string", "description": "HH:MM, 24-hour"},
         "guests": {"type": "integer", "minimum": 1, "maximum": 20},
         "contact": _obj({"name": S, "phone": {"type": ["string", "null"]}}, ["name"])},
        ["restaurant", "time", "guests"])),
    "convert_currency": ("Convert an amount between currencies (ISO codes).", _obj(
        {"amount": {"type": "number", "exclusiveMinimum": 0},
         "from_currency": {"type": "string", "minLength": 3, "maxLength": 3},
         "to_currency": {"type": "string", "minLength": 3, "maxLength": 3}},
        ["amount", "from_currency", "to_currency"])),
    "set_reminder": ("Remind the user of something later.", _obj(
        {"message": S, "minutes_from_now": {"type": "integer", "minimum": 1},
         "repeat": {"type": "boolean"}}, ["message", "minutes_from_now"])),
    "lookup_user": ("Find a user account by numeric id or by email address.", {
        "type": "object", "additionalProperties": False, "anyOf": [
            {"required": ["user_id"]}, {"required": ["email"]}],
        "properties": {"user_id": {"type": "integer", "minimum": 1}, "email": S}}),
    "translate_text": ("Translate text into another language.", _obj(
        {"text": S, "target_language": S}, ["text", "target_language"], closed=False)),
    "get_stock_price": ("Latest price of a stock by ticker symbol.", _obj(
        {"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}, ["symbol"])),
}

# (the function that answers best, the user's request)
REQUESTS: list[tuple[str, str]] = [
    ("get_weather", "What's the weather like in Lisbon right now?"),
    ("get_weather", "Is it cold in Montreal today? Give me the temperature in fahrenheit."),
    ("get_weather", "Tell me the current weather in Nairobi."),
    ("get_weather", "How warm is it in Osaka at the moment, in celsius?"),
    ("get_weather", "Should I take an umbrella in Dublin? Check the weather."),
    ("add_numbers", "What is 17 plus 25?"),
    ("add_numbers", "Add 1024 and 2048 for me."),
    ("add_numbers", "Compute the sum of -8 and 13."),
    ("add_numbers", "I have 36 apples and buy 7 more. Use the tool to add them."),
    ("add_numbers", "Please add 999 and 1."),
    ("search_flights", "Find flights from JFK to LHR on 2026-12-20."),
    ("search_flights", "I need two seats from SFO to NRT on 2027-01-05."),
    ("search_flights", "Search for a flight from CDG to FCO on 2026-12-31 for one passenger."),
    ("search_flights", "Are there flights from BOS to MIA on 2027-02-14 for four people?"),
    ("search_flights", "Look up flights ORD to DEN, March 3rd 2027 (2027-03-03)."),
    ("send_email", "Email alice@example.com with subject 'Lunch' saying I'll be 10 minutes late."),
    ("send_email", "Send bob@example.org an email titled 'Report' with the body 'Attached.'"),
    ("send_email", "Write to team@example.com, subject 'Standup moved', body 'Now at 10:30.', "
                   "and cc carol@example.com."),
    ("send_email", "Send an email to hr@example.com asking for a copy of my contract; use "
                   "'Contract copy' as the subject."),
    ("send_email", "Notify ops@example.net by email that the backup finished. Subject: "
                   "Backup done."),
    ("set_thermostat", "Set the thermostat to 21 degrees on heat."),
    ("set_thermostat", "Cool the house down to 19.5 degrees."),
    ("set_thermostat", "Put the thermostat in auto mode at 22."),
    ("set_thermostat", "It's freezing: heat to 24 degrees please."),
    ("set_thermostat", "Change the thermostat to cooling at 18 degrees."),
    ("create_order", "Order 2 boxes of green tea."),
    ("create_order", "Buy 1 laptop stand and 3 USB-C cables, express shipping."),
    ("create_order", "Place an order for 12 pencils."),
    ("create_order", "I want 4 bags of coffee beans and 1 grinder, no rush on delivery."),
    ("create_order", "Order a single yoga mat with express delivery."),
    ("book_table", "Book a table for 4 at Luigi's at 19:30."),
    ("book_table", "Reserve Sakura for two people at 20:00 under the name Kim."),
    ("book_table", "Get me a table at The Green Fork at 12:15 for 6 guests; my name is Omar "
                   "and my phone is 555-0142."),
    ("book_table", "Table for one at Cafe Nord at 08:00 please."),
    ("book_table", "Make a dinner reservation at Blue Harbor, 21:00, 3 guests."),
    ("convert_currency", "How much is 100 USD in EUR?"),
    ("convert_currency", "Convert 2500 JPY to GBP."),
    ("convert_currency", "What do 75.5 euros come to in Swiss francs (CHF)?"),
    ("convert_currency", "Change 1 BTC... no, 40 CAD into AUD."),
    ("convert_currency", "I have 12000 INR; how many USD is that?"),
    ("set_reminder", "Remind me to call mom in 30 minutes."),
    ("set_reminder", "Set a reminder to stretch every 60 minutes, repeating."),
    ("set_reminder", "In 5 minutes, remind me to take the pizza out of the oven."),
    ("set_reminder", "Remind me about the meeting in two hours (120 minutes)."),
    ("set_reminder", "Ping me in 15 minutes to check the laundry."),
    ("lookup_user", "Find the account with user id 4821."),
    ("lookup_user", "Who is the user with email dana@example.com?"),
    ("lookup_user", "Look up user number 7."),
    ("lookup_user", "Pull up the account registered to sam.lee@example.org."),
    ("lookup_user", "Show me the user whose id is 100234."),
    ("translate_text", "Translate 'good morning' into Spanish."),
    ("translate_text", "How do you say 'where is the station' in German?"),
    ("translate_text", "Translate 'thank you very much' to Japanese."),
    ("translate_text", "Put 'the meeting is cancelled' into French."),
    ("translate_text", "Translate the phrase 'happy birthday' into Italian."),
    ("get_stock_price", "What's Apple's stock price? The ticker is AAPL."),
    ("get_stock_price", "Check the latest price of MSFT."),
    ("get_stock_price", "How is NVDA trading right now?"),
    ("get_stock_price", "Get me the current share price for ticker TSLA."),
    ("get_stock_price", "Quote for IBM stock please."),
]


def offered(index: int) -> list[str]:
    """The three functions offered with request `index`: its own and two others, rotated."""
    names = list(FUNCTIONS)
    own = names.index(REQUESTS[index][0])
    others = [names[(own + 1 + index % 5) % len(names)], names[(own + 7 + index % 3) % len(names)]]
    if others[0] == others[1] or own in (names.index(o) for o in others):
        others[1] = names[(own + 11) % len(names)]
    trio = [names[own], *others]
    rotation = index % 3
    return trio[rotation:] + trio[:rotation]


def tool_list(names: list[str]) -> list[dict[str, Any]]:
    """OpenAI `tools` entries for these functions."""
    return [{"type": "function", "function": {"name": n, "description": FUNCTIONS[n][0],
                                              "parameters": FUNCTIONS[n][1]}} for n in names]
